pytest_plugins = [
    "kimi_perf.plugin",
    "fixtures.models",
    "fixtures.servers",
    "fixtures.workloads",
]
