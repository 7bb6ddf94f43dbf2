"""Running our own training job: `launch` prepares the run directory and starts the world, `worker` is one
rank (data -> model -> strategy -> `loop`), `hooks` are the named points the loop and the strategies emit,
`stepclock` times each step, `topology` derives and checks the rank layout, `checkpoint` saves and loads
recovery checkpoints (`safeload` loads one without running its pickles, `recovery` picks the one a recovered
path resumes from), `complete` seals the run. `usercmd` runs a user's own command instead, in a prepared
run directory."""
