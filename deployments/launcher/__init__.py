"""Starting the cluster on this machine: ``cluster serve`` (Ray, Serve, the app and Serve's HAProxy
with our listeners) and ``cluster lab`` (a RayService's pods as Ray nodes in network namespaces)."""
