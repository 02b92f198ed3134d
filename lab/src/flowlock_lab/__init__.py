"""flowlock's lab: soak and faults, namespaced hosts, the HTTP driver, embedded Redis HA.

Tools and tests use it; flowlock itself does not.
"""

__version__ = "0.1.0"
