"""The silod node agent (`silod agent`): one per GPU node (a DaemonSet), the only privileged
silod component. It runs the node's FUSE mounts, one per dataset, over the node's persistent
cache, and serves the CSI Identity and Node services (csi.proto, the subset we need) on a unix
socket: kubelet's NodePublishVolume bind-mounts the dataset's mount read-only into a pod, so
training pods need no privilege, no hostPath and no sidecar (the paper's §6: one FUSE client
per server; Fluid's CSI pattern).
"""
