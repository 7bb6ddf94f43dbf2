"""What a job records, each an observer at the hook points: the trajectory (`recorder`, its tensor digests
in `digest`, `devdigest` for accelerator tensors, `fused` the optional compiled pass, `scales` the
magnitudes behind gradients), the collective trace (`flightrec` from torch's Flight Recorder, `collectives`
with values), the memory ledger (`memory`), depth recording inside one step (`depth`) and the live replica
check (`livecheck`)."""
