# The plugin also comes from the pytest11 entry point (pyproject.toml) once kimi-perf is installed;
# the entry point has this module's name, so listing it here is a no-op then and the registration when
# the checkout runs without the package installed (or with PYTEST_DISABLE_PLUGIN_AUTOLOAD=1). fixtures/
# is this repository's pytest-facing layer for perf_tests/ and is not installed with the package.
pytest_plugins = [
    "pytester",
    "kimi_perf.plugin",
    "fixtures.models",
    "fixtures.servers",
    "fixtures.workloads",
    "fixtures.alignment",
    "fixtures.drafters",
    "fixtures.ab",
    "fixtures.matrix",
]
