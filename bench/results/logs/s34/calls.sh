# Session 34's device calls (nvidia-h200), each from the repository root with .whl carried.
# call 1 (245 s): the whole e2e on the memfd version of the shared step frames (1d92b4b; the step
# paths were not recorded yet: the coordinator's logs stay on the device)
E2E_S=290 E2E_DEADLINE=270 OUT=$OUT bash bench/gpu_suite.sh e2e
