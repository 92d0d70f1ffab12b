# Sourced by the Fashion-MNIST-C benchmark scripts (device_bench.sh, methods_table.sh, norm_table.sh), after
# they set WORK and TEST_PER_CLASS: the corruptions of docs/results/, the folders
# `cafa demo --data-only` builds them in, and cafa itself.
REPORTED=${REPORTED:-"gaussian_noise shot_noise impulse_noise defocus_blur glass_blur motion_blur zoom_blur snow frost fog brightness contrast elastic_transform pixelate jpeg_compression"}
HELD_OUT=${HELD_OUT:-"speckle_noise gaussian_blur spatter saturate"}
SEVERITY=${SEVERITY:-3}
PY=${PY:-python3}
cafa() { "$PY" -m cafa_cli "$@"; }
FOLDER=$WORK/$([ "$TEST_PER_CLASS" = 0 ] && echo fashion-mnist-c || echo "fashion-mnist-c-$TEST_PER_CLASS")
domains() { for c in $1; do echo "$FOLDER/$c/$SEVERITY"; done; }  # the domain folders of the corruptions in $1
