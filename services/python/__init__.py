"""The python service: Triton python-backend models (model.py), one worker process per instance."""
