"""The control plane's Prometheus side: its metrics (`metrics`), what a scrape adds from the database
(`collector`), and the token-protected /metrics and agent service-discovery endpoints (`views`)."""
