"""`disttrace lab`: the whole method as one command, and the curriculum's labs (manifests/labs/)."""
