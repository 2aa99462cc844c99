"""Offline jobs in OpenAI's batch file format: `tessera run-batch` and the gateway's Batch API.

Data flow: an input file (format.py parses and validates it into BatchLines) -> each line sent
through the gateway's own OpenAI serving path (executor.py) -> one output record per line.
The Batch API (routes.py, wired into the gateway by entrypoints/gateway/batch_api.py) keeps
files in a directory (files.py, multipart.py) and job state in Redis or its in-process twin
(redis_jobs.py, jobs.py); whichever gateway holds a job's lease runs it (runner.py).
"""
