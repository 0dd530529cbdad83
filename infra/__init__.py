"""What composes the services: the ``conveyor`` command, the local launcher (``conveyor up``), the
process stack used by tests and benchmarks, and the container images (Dockerfile beside these).

It sits above ``gateway``, ``scheduler`` and ``executor`` (which never import it), as ``common``
sits below them.
"""
