"""Core: what a job is, before any graph exists (layer 1, above the TensorFlow adapter).

The configuration (``config``), the cluster of workers and devices (``cluster``), how
TaskGraphs and replicas are laid out on those devices (``layout``), the process-wide
state ``epl.init`` sets (``process_state``), the host heap it keeps (``host_heap``) and
the files a worker and ``epl-launch`` exchange (``worker_files``).  Nothing here edits a
graph; it may import only the adapter.
"""
