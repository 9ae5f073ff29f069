"""What a rank holds, by device and kind: :class:`MemoryReport` (``ZeroDDP.memory_report``)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["MEMORY_KINDS", "MemoryReport"]

MEMORY_KINDS = ("parameters", "gathered_buffers", "gradients", "fp32_master", "optimizer_states")


@dataclass
class MemoryReport:
    """Bytes this rank holds, per device and kind, plus the placement decisions.

    Attributes:
        bytes: ``{device: {kind: bytes}}``, each tensor counted on the device it is on now, with kinds
            ``parameters`` (persistent parameter shards: compute dtype for trainable chunks — the fp32
            master itself in fp32 —, the storage dtype for frozen chunks, see
            :attr:`frozen_parameters`; keep-gathered chunks whole), ``gathered_buffers`` (sharded chunks gathered or
            being gathered now), ``gradients`` (chunk gradient buffers, reductions in flight and fp32
            gradient shards), ``fp32_master`` (master shards held apart from the parameter shard: 0
            in fp32, where they coincide; none for frozen chunks), ``optimizer_states`` (the
            ZeroOptimizer's state shards, when it is passed).
        offload_optim_chunks: chunk indices whose master, gradient and optimizer state are on the host.
        offload_param_chunks: chunk indices whose parameter shard is on the host.
        peak_gathered_chunks: the most sharded chunks gathered at once so far.
        frozen_parameters: ``{device: {dtype name: bytes}}`` — the part of ``parameters`` that frozen
            chunks hold, by dtype: each frozen shard in the dtype its tensors came in (a bf16 frozen
            tensor costs 2 bytes per element of this rank's shard whatever the compute dtype), plus
            the compute-dtype copy a keep-gathered frozen chunk stored in another dtype keeps.
    """

    bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    offload_optim_chunks: tuple[int, ...] = ()
    offload_param_chunks: tuple[int, ...] = ()
    peak_gathered_chunks: int = 0
    frozen_parameters: dict[str, dict[str, int]] = field(default_factory=dict)

    @classmethod
    def collect(cls, chunks, device, optimizer=None, **decisions) -> MemoryReport:
        """The report of what ``chunks`` (:class:`~torch_backend.zero.chunks.Chunk`) and ``optimizer``'s
        state shards hold now; ``device``: the compute device (always listed); ``decisions``: the
        placement fields (``offload_optim_chunks``, ``offload_param_chunks``, ``peak_gathered_chunks``)."""
        report: dict[str, dict[str, int]] = {}

        def add(where, kind, n):
            per = report.setdefault(str(where), {k: 0 for k in MEMORY_KINDS})
            per[kind] += int(n)

        add(device, "parameters", 0)
        frozen: dict[str, dict[str, int]] = {}
        for c in chunks:
            for where, kind, n in c.bytes_by_kind():
                add(where, kind, n)
            for where, dtype, n in c.frozen_bytes_by_dtype():
                per = frozen.setdefault(str(where), {})
                per[dtype] = per.get(dtype, 0) + int(n)
        if optimizer is not None:
            for where, n in optimizer.state_bytes():
                add(where, "optimizer_states", n)
        return cls(report, frozen_parameters=frozen, **decisions)

    def total(self, kind: str | None = None, device: str | None = None) -> int:
        """Bytes of ``kind`` (all kinds when ``None``) on ``device`` (all devices when ``None``)."""
        return sum(b for dev, per in self.bytes.items() if device is None or dev == device
                   for k, b in per.items() if kind is None or k == kind)

    def frozen_total(self, dtype: str | None = None, device: str | None = None) -> int:
        """Bytes of frozen parameters in ``dtype`` (e.g. ``"bfloat16"``; all when ``None``) on ``device``."""
        return sum(b for dev, per in self.frozen_parameters.items() if device is None or dev == device
                   for d, b in per.items() if dtype is None or d == dtype)

    def model_state_bytes(self) -> int:
        """Parameters + gradients + fp32 master + optimizer states (gathered buffers excluded)."""
        return self.total() - self.total("gathered_buffers")

    def __str__(self) -> str:
        lines = ["| device | " + " | ".join(MEMORY_KINDS) + " |", "|---" * (len(MEMORY_KINDS) + 1) + "|"]
        for dev, per in self.bytes.items():
            lines.append(f"| {dev} | " + " | ".join(str(per.get(k, 0)) for k in MEMORY_KINDS) + " |")
        for dev, per in self.frozen_parameters.items():
            lines.append(f"frozen parameters on {dev}: " + ", ".join(f"{d} {b}" for d, b in sorted(per.items())))
        lines.append(f"offloaded optimizer chunks: {list(self.offload_optim_chunks)}; parameter chunks: "
                     f"{list(self.offload_param_chunks)}; peak gathered chunks: {self.peak_gathered_chunks}")
        return "\n".join(lines)
