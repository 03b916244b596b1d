"""The accelerator check (device_check with its phases and report; device_run.sh and
pack_device_wheels.sh on and for the lent machine, docs/gpu.md) and model sizing
(model_shapes: the memory plan of a known shape before any download)."""
