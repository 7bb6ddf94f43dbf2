"""The run store: its layout, atomic writers, validating readers and checkpoint indexes. No torch here:
a run written on a cluster is read on a laptop."""
