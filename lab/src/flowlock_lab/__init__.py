"""flowlock's lab: the soak and fault harness, namespaced hosts, the HTTP driver, and
embedded Redis Sentinel and Cluster servers. Tools and tests use it; flowlock does not."""

__version__ = "0.1.0"
