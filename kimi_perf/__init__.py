"""kimi-perf: a pytest-driven performance regression suite for LLM serving with EAGLE-3.

The package is imported by pytest at collection time (through the plugin), so nothing here imports
torch, transformers or an engine: those load lazily inside the functions that need them, keeping
``pytest --collect-only`` and ``-m "not perf"`` fast on machines without a GPU.
"""

__version__ = "0.1.0"
