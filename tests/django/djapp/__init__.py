"""A Django app of the tests: an Order model of the project's own, its workflows and a view."""
