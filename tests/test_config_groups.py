"""`memtrain --help` and the usage page's group table come from conf/
(memtrain/groups.py)."""

from conftest import CONF, ROOT, conf_options

from memtrain.config import groups


def test_help_names_memtrain_its_groups_and_examples(cli_checks):
    p = cli_checks("--help")
    assert p.returncode == 0 and p.stderr == ""
    text = p.stdout
    assert text.startswith("memtrain: how much memory does a training run need")
    for group in groups.GROUPS:
        assert f"\n  {group}" in text
        for option in conf_options(group):
            assert option in text, (group, option)
    assert "none*" in text and "resnet18*" in text and "synthetic*" in text  # the defaults
    assert "Examples:" in text and "trainer.estimate=true" in text and "--hydra-help" in text
    assert "base_trainer" not in text and "report:" not in text  # no schema, no display group


def test_every_group_folder_is_described():
    """A new group (a folder of conf/) needs its one line in groups.GROUPS; conf/report holds
    the report's display settings, no group a run chooses (conf/ is a package: Python's
    __pycache__ may sit beside them)."""
    folders = {p.name for p in CONF.iterdir() if p.is_dir()} - {"report", "__pycache__"}
    assert folders == set(groups.GROUPS)


def test_the_usage_page_holds_the_generated_group_table():
    text = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    assert groups.with_table(text) == text, \
        "run: python -m memtrain.config.groups --write docs/usage.md"
    assert "| `method` | the memory-saving method" in text
