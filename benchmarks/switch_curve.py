"""One run that switches engine at its checkpoints, against the single-engine run and its fp32 noise floor.

Three ``chunkzero train`` runs of the same job (gpt-tiny, the same 12 sequences per step at every world
size — micro-batch *i* is the same global batch whenever world size × ``--batch-size`` is):

- **reference**: torch, W = 2 (``--batch-size 6``), all ``--steps``;
- **floor**: torch, W = 3 (``--batch-size 4``), all steps: the same run with another summation order
  (gradients reduced over 3 ranks instead of 2), the fp32 noise floor;
- **switch**: the reference's first third (its checkpoint, the same bytes a first leg would write),
  then ``--resume --backend jax --nproc 2 --devices-per-process 2`` (4 devices, ``--batch-size 3``) for the
  second third, then ``--resume`` torch at W = 3 (``--batch-size 4``) for the last.

Prints the worst training-loss difference to the reference over the steps the switch run trained
(steps after the first third), the worst validation-loss difference, and the parameters' normwise
relative error ``‖θ − θ_ref‖ / ‖θ_ref‖`` at the two later checkpoints, for the switch run and for the
floor; writes ``docs/switch_curve.png`` (the three loss curves and both differences per step).

    .venv/bin/python benchmarks/switch_curve.py [--steps 60] [--plot docs/switch_curve.png]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import numpy as np  # noqa: E402
from train_runs import CORPUS_FILES as STDLIB_CORPUS_FILES  # noqa: E402
from train_runs import make_corpus, train_env  # noqa: E402 - after the sys.path set-up

GLOBAL_BATCH = 12
CORPUS_FILES = (*STDLIB_CORPUS_FILES, "pathlib/__init__.py")
"""About 1 MB of the standard library's source (files that are missing are skipped)."""


def train(*args: str, cwd: Path) -> float:
    """Run ``chunkzero train`` (this checkout); its wall time in seconds. Raises on a non-zero exit."""
    env = train_env()
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "chunkzero.cli", "train", *args], cwd=cwd, env=env,
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"chunkzero train {' '.join(args)} failed (exit {p.returncode}):\n{p.stderr[-4000:]}")
    return time.perf_counter() - t0


def losses(out: Path) -> tuple[dict[int, float], dict[int, float]]:
    """``({step: train loss}, {step: val loss})`` of ``out/metrics.jsonl``."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return ({r["step"]: r["loss"] for r in records if r["kind"] == "train"},
            {r["step"]: r["val_loss"] for r in records if r["kind"] == "val"})


def params_at(out: Path, step: int) -> dict[str, np.ndarray]:
    """Every tensor of checkpoint ``step`` of a run, fp32 numpy by name (JAX restore on one device)."""
    import jax_backend as jb

    restored = jb.restore_checkpoint(out / "checkpoints" / str(step), jb.make_mesh(1))
    return {k: np.asarray(v) for k, v in jb.unflatten(restored.chunks, restored.layout, nested=False).items()}


def rel_err(got: dict, ref: dict) -> float:
    num = sum(float(((got[n].astype(np.float64) - ref[n]) ** 2).sum()) for n in ref)
    den = sum(float((ref[n].astype(np.float64) ** 2).sum()) for n in ref)
    return (num / den) ** 0.5


def plot(path: Path, steps: int, ref: dict, floor: dict, switch: dict, legs: tuple[int, int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=(3, 2))
    xs = sorted(ref)
    top.plot(xs, [ref[s] for s in xs], label="torch, W = 2 (reference)", color="C0", lw=2)
    top.plot(xs, [floor[s] for s in xs], label="torch, W = 3 (another summation order)", color="C2", lw=1, ls="--")
    sx = sorted(switch)
    top.plot(sx, [switch[s] for s in sx], label="switch: torch W=2 → JAX 2×2 devices → torch W=3", color="C3", lw=1)
    for ax in (top, bottom):
        ax.axvspan(legs[0] + 0.5, legs[1] + 0.5, color="0.92", zorder=0)
        ax.axvline(legs[0] + 0.5, color="0.5", lw=0.6)
        ax.axvline(legs[1] + 0.5, color="0.5", lw=0.6)
    top.set_ylabel("training loss (nats/byte)")
    top.legend(loc="upper right", fontsize=8)
    top.set_title("One run, two engines (grey: the JAX leg), gpt-tiny, 12 sequences × 64 bytes per step", fontsize=9)
    later = [s for s in xs if s > legs[0]]
    bottom.semilogy(later, [abs(switch[s] - ref[s]) + 1e-9 for s in later], color="C3", label="|switch − reference|")
    bottom.semilogy(later, [abs(floor[s] - ref[s]) + 1e-9 for s in later], color="C2", ls="--",
                    label="|W = 3 − reference| (fp32 noise floor)")
    bottom.set_xlabel("step")
    bottom.set_ylabel("|Δ loss|")
    bottom.legend(loc="lower right", fontsize=8)
    bottom.set_xlim(0, steps + 1)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="steps of every run, divisible by 3")
    ap.add_argument("--plot", type=Path, default=REPO / "docs" / "switch_curve.png")
    ap.add_argument("--work", type=Path, default=None, help="where the runs go (default: a temporary directory)")
    args = ap.parse_args(argv)
    if args.steps % 3 or args.steps < 6:
        ap.error("--steps must be a multiple of 3, at least 6")
    third = args.steps // 3
    with tempfile.TemporaryDirectory(prefix="switch-curve-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        corpus = make_corpus(work / "corpus", CORPUS_FILES)
        common = ["--model", "gpt-tiny", "--seq-len", "64", "--lr", "3e-3", "--warmup", "5", "--steps", str(args.steps),
                  "--eval-interval", str(max(1, third // 2)), "--eval-batches", "4", "--save-interval", str(third),
                  "--sample-tokens", "0", "--data", str(corpus), "--overwrite"]
        ref_out, floor_out, switch_out = work / "reference", work / "floor", work / "switch"
        times = {}
        times["reference"] = train(*common, "--nproc", "2", "--batch-size", str(GLOBAL_BATCH // 2), "--out",
                                   str(ref_out), cwd=work)
        times["floor"] = train(*common, "--nproc", "3", "--batch-size", str(GLOBAL_BATCH // 3), "--out",
                               str(floor_out), cwd=work)
        if switch_out.exists():
            shutil.rmtree(switch_out)
        shutil.copytree(ref_out, switch_out)  # leg 1 = the reference's steps 1 … third (torch, W = 2)
        for s in (2 * third, 3 * third):
            shutil.rmtree(switch_out / "checkpoints" / str(s))
        resume = [a for a in common if a != "--overwrite"] + ["--resume", "--out", str(switch_out)]
        times["jax leg"] = train(*resume, "--backend", "jax", "--nproc", "2", "--devices-per-process", "2",
                                 "--batch-size", str(GLOBAL_BATCH // 4), cwd=work)
        shutil.rmtree(switch_out / "checkpoints" / str(3 * third))  # torch resumes from JAX's checkpoint 2·third
        times["torch leg"] = train(*resume, "--nproc", "3", "--batch-size", str(GLOBAL_BATCH // 3), cwd=work)

        (ref_t, ref_v), (floor_t, floor_v), (sw_t, sw_v) = losses(ref_out), losses(floor_out), losses(switch_out)
        later = [s for s in sorted(ref_t) if s > third]
        worst = {
            name: max(abs(run[s] - ref_t[s]) for s in later) for name, run in (("switch", sw_t), ("floor", floor_t))
        }
        later_v = [s for s in sorted(ref_v) if s > third]
        worst_v = {
            name: max(abs(run[s] - ref_v[s]) for s in later_v) for name, run in (("switch", sw_v), ("floor", floor_v))
        }
        param = {}
        for s in (2 * third, 3 * third):
            ref_p = params_at(ref_out, s)
            param[s] = {
                "switch": rel_err(params_at(switch_out, s), ref_p),
                "floor": rel_err(params_at(floor_out, s), ref_p),
            }
        plot(args.plot, args.steps, ref_t, floor_t, sw_t, (third, 2 * third))

    print(f"gpt-tiny, {args.steps} steps of {GLOBAL_BATCH} × 64 bytes; switch at steps {third} (torch W=2 → JAX 2×2) "
          f"and {2 * third} (JAX → torch W=3); floor: torch W=3 vs W=2")
    print()
    print("| measure (vs torch W = 2, after step %d) | switch run | fp32 floor (torch W = 3) |" % third)
    print("|---|---|---|")
    print(f"| worst training-loss difference (nats/byte) | {worst['switch']:.2e} | {worst['floor']:.2e} |")
    print(f"| worst validation-loss difference (nats/byte) | {worst_v['switch']:.2e} | {worst_v['floor']:.2e} |")
    for s, e in param.items():
        print(f"| parameters at step {s}, ‖θ − θ_ref‖ / ‖θ_ref‖ | {e['switch']:.2e} | {e['floor']:.2e} |")
    print()
    print("wall times: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()) + f"; plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
