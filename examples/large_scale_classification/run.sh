# epl-launch --num_workers 1 --gpu_per_worker 4 run.sh   (4 devices of one worker)
# epl-launch --num_workers 2 --gpu_per_worker 1 run.sh   (the split spans 2 workers)
python train.py "$@"
