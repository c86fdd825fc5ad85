"""What the graph runner (graph_runner.py) and the device graph backends (acl_graph.py) share, in a module of its
own so that neither imports the other for it."""


class GraphModeUnavailable(RuntimeError):
    """This device has a graph backend, but it cannot be used here (the reason is logged)."""
