# The local launch script: epl-launch --num_workers 1 --gpu_per_worker 2 run.sh
python bert_pipeline.py
