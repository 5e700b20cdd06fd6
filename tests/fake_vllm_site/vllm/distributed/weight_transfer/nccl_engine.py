"""FAKE vLLM (tests only): names TRL's vllm_client imports for vLLM < 0.28 (its server mode, never used here)."""


class NCCLTrainerSendWeightsArgs:
    pass


class NCCLWeightTransferEngine:
    pass
