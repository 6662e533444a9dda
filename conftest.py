# pytester drives the plugin's own tests; pytest only honours pytest_plugins in the root conftest.
pytest_plugins = ("pytester",)
