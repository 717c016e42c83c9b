pytest_plugins = [
    "pytester",
    "kimi_perf.plugin",
    "fixtures.models",
    "fixtures.servers",
    "fixtures.workloads",
    "fixtures.alignment",
    "fixtures.drafters",
    "fixtures.ab",
]
