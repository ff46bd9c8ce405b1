"""The public names are a contract with users: each resolves from `hf_mars` itself."""

import hf_mars


def test_public_names_resolve():
    for name in hf_mars.__all__:
        assert getattr(hf_mars, name) is not None, name
    for name in ("MARSConfig", "MARSTrainer", "add_mask_token", "mars_generate", "enable_mars", "save_for_hub",
                 "push_to_hub"):
        assert name in hf_mars.__all__


def test_cli_has_the_documented_commands():
    from hf_mars.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(sub.choices) == {"demo", "bench", "push", "serve"}
