"""The project's own reference engine (a continuous-batching Llama server with EAGLE-3), see server.py.

Only constants live here: importing this package must stay free of torch, so the A/B planner can
name the engine's switches without loading the engine.
"""

# The planted-slowdown switch, a fraction (0.10 = every decode step 10% slower); see engine.py.
PLANT_ENV = "KIMI_PERF_PLANT_SLOWDOWN"
