"""The scorer's shell built from its section and a RunContext (its SQL worker processes start): it opens databases
under the context's data dir only."""
from actors.scorer import ScorerShell
from config import RunContext, ScorerConfig


def test_the_scorer_opens_databases_under_its_context_s_data_dir_only(tmp_path):
    shell = ScorerShell(ScorerConfig(workers=1), RunContext(data_dir=str(tmp_path / "data")), scorer_id="scorer-3")
    try:
        assert shell.scorer.db_root == str(tmp_path / "data") and shell.scorer.scorer_id == "scorer-3"
        assert shell.loop.reclaim_idle_s == RunContext().reclaim_idle_s
    finally:
        shell.scorer.close()

