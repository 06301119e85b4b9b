"""The default names of the mesh's two axes, declared once: ``node`` (between nodes, the slow
links the codecs compress for) and ``local`` (the devices of one node)."""

NODE_AXIS = "node"
LOCAL_AXIS = "local"
