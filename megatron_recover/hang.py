"""The hang timeout's constants: --recover-hang-timeout's default and the bounds derived from it.

A --recover run declares a rank that stops answering failed after the hang timeout (Open MPI's
failure detector, `runtime.configure_hang_detection`); waits on a live but slow peer are bounded
by multiples of it. Imports nothing, so every part of the package (the glue, the launcher, the
goodput model) takes them from here.
"""

# --recover-hang-timeout's default, seconds. Minutes-long stalls are rare on healthy GPU
# clusters, and a heartbeat every 30 s costs nothing measurable; tests use a few seconds.
DEFAULT_HANG_TIMEOUT_S = 60.0

# Waits that outlive LAST_RESORT_FACTOR x --recover-hang-timeout make a rank leave (the
# cross-replica groups' and megatron's own groups' timeouts); a healthy long compute of a few
# times the hang timeout stays far below it.
LAST_RESORT_FACTOR = 10
