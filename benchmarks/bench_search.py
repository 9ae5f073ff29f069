"""Chunk-size search: padding plus waste of ColossalAI Gemini's search vs chunkzero's, for GPT-2 small,
GPT-2 medium and a Llama-style 1B (sizes only, no model is built) at world sizes 2, 3, 4 and 8.

Prints a markdown table (about a second):

    .venv/bin/python benchmarks/bench_search.py
"""

from chunkzero.search import format_waste_table, waste_table

if __name__ == "__main__":
    print(format_waste_table(waste_table()))
