"""FAKE vLLM (tests only): what TRL imports from here at import time."""


def get_ip() -> str:
    return "127.0.0.1"
