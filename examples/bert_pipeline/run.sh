# The local launch script (`bash run.sh` alone: the GPUs, or 2 virtual CPU devices):
#   epl-launch --num_workers 1 --gpu_per_worker 2 run.sh   (both stages on one worker)
#   epl-launch --num_workers 2 --gpu_per_worker 1 run.sh   (stage 1 on the second worker)
python bert_pipeline.py "$@"
