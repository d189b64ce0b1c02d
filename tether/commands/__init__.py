"""The operator's commands: the ``tether`` CLI, ``tether up`` (the local launcher), ``tether status`` and the
console. The top layer of the import graph: it may import the process packages and the libraries, and
nothing below it imports it (``tests/unit/test_layering.py``)."""
