# Seed 001 §3.2: the local launch script epl-launch runs on every worker.
python local_model.py
