# The local launch script:
#   epl-launch --num_workers 1 --gpu_per_worker 2 run.sh   (both stages on one worker)
#   epl-launch --num_workers 2 --gpu_per_worker 1 run.sh   (stage 1 on the second worker)
python bert_pipeline.py
