"""Running on several processes: the launcher, joining a cluster, huge pages, the
workers' output and the two-thread program scheduler."""
