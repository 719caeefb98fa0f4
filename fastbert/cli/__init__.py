"""The two commands of `python -m fastbert`: the main job (main_job.py) and encode (encode.py)."""
