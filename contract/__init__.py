"""The contract between the control plane (scheduler/, datamanager/) and the data path (fuse_client/).

Both planes import these small modules and nothing of each other: which dataset URIs an operator
allows (uri_policy), how a tenant's credential reaches a mount process (credentials), how datasets
and jobs are named outside the database (names), and the mount's stats file (stats_file).
"""
