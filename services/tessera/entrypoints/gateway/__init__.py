"""The gateway process: FastAPI app (app.py) serving OpenAI's API in front of a worker."""
