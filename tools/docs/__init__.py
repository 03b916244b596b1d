"""Writers of generated files under docs/: the Grafana dashboard (grafana_dashboard, kept in
step by tests/tools/test_grafana_dashboard.py) and the web pages' screenshots (web_screenshots)."""
