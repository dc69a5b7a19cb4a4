# epl-launch --num_workers 1 --gpu_per_worker 4 run.sh
python train.py "$@"
