"""Starting a job's workers: where they go on the cluster (`placement`), what the driver hands
each (`specs`, and region graphs as plain node lists, `packed_graphs`), and workers kept for the
next job of the same shape (`pool`).

The lowest room of the runtime: it imports no other room, so the driver and every room may read it.
"""
