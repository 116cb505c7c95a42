"""The environment's record of which files ran, and tools/verify_provenance.py's check of it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hopperbench.environment import EnvironmentRecord, _repo_state, working_tree_id
from hopperbench.paths import REPO_ROOT
from hopperbench.devcheck import load_module_by_path

verify = load_module_by_path(REPO_ROOT / "tools/verify_provenance.py", "verify_provenance")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    git(tmp_path, "init", "-q")
    git(tmp_path, "config", "user.email", "t@example.com")
    git(tmp_path, "config", "user.name", "t")
    (tmp_path / "kernel.py").write_text("A = 1\n")
    (tmp_path / ".gitignore").write_text("ignored/\n")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-q", "-m", "one")
    return tmp_path


def test_tree_id_is_the_commits_tree_for_its_files_whatever_is_ignored(repo: Path) -> None:
    (repo / "ignored").mkdir()
    (repo / "ignored" / "build.bin").write_text("x")
    assert working_tree_id(repo) == git(repo, "rev-parse", "HEAD^{tree}")
    assert git(repo, "status", "--porcelain") == ""  # the ignored file is not part of the checkout


def test_tree_id_changes_with_an_edited_or_an_untracked_file_and_leaves_the_index_alone(repo: Path) -> None:
    head_tree = git(repo, "rev-parse", "HEAD^{tree}")
    (repo / "kernel.py").write_text("A = 2\n")
    edited = working_tree_id(repo)
    assert edited != head_tree
    (repo / "kernel.py").write_text("A = 1\n")
    (repo / "new.py").write_text("B = 1\n")
    assert working_tree_id(repo) not in (head_tree, edited)
    assert git(repo, "diff", "--cached", "--name-only") == ""  # the real index is untouched


def test_a_copy_whose_git_head_is_older_still_matches_the_commit_it_holds(repo: Path) -> None:
    """The GPU-host case: the copy's .git sits at an older commit, the files are a newer one's."""
    old = git(repo, "rev-parse", "HEAD")
    (repo / "kernel.py").write_text("A = 2\n")
    git(repo, "commit", "-q", "-am", "two")
    new_tree = git(repo, "rev-parse", "HEAD^{tree}")
    git(repo, "reset", "-q", "--soft", old)  # HEAD back, files stay the new commit's
    assert working_tree_id(repo) == new_tree


def test_a_declared_commit_wins_and_keeps_the_copys_own_head(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOPPERBENCH_SOURCE_COMMIT", "f" * 40)
    monkeypatch.setenv("HOPPERBENCH_SOURCE_DIRTY", "0")
    state = _repo_state(repo)
    assert state["repo_commit"] == "f" * 40 and state["repo_commit_source"] == "declared"
    assert state["repo_git_head"] == git(repo, "rev-parse", "HEAD") and state["repo_dirty"] is False
    assert state["repo_tree"] == git(repo, "rev-parse", "HEAD^{tree}")
    assert state["repo_changes"] == []


def test_the_copys_changes_are_recorded_to_explain_a_tree_mismatch(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOPPERBENCH_SOURCE_COMMIT", git(repo, "rev-parse", "HEAD"))
    (repo / "kernel.py").write_text("A = 2\n")
    (repo / "stray.log").write_text("x\n")
    state = _repo_state(repo)
    assert state["repo_changes"] == [" M kernel.py", "?? stray.log"]
    record = EnvironmentRecord.model_validate(state)
    verdict, detail = verify.verdict_for(record, repo)
    assert verdict is verify.Verdict.MISMATCH and "?? stray.log" in detail and " M kernel.py" in detail


def test_without_a_declaration_git_decides(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HOPPERBENCH_SOURCE_COMMIT", raising=False)
    state = _repo_state(repo)
    assert state["repo_commit"] == git(repo, "rev-parse", "HEAD") and state["repo_commit_source"] == "git"
    assert state["repo_dirty"] is False


def test_verdicts(repo: Path) -> None:
    head = git(repo, "rev-parse", "HEAD")
    tree = git(repo, "rev-parse", "HEAD^{tree}")
    record = EnvironmentRecord(repo_commit=head, repo_tree=tree, repo_commit_source="declared")
    assert verify.verdict_for(record, repo)[0] is verify.Verdict.VERIFIED
    other = record.model_copy(update={"repo_tree": "0" * 40})
    assert verify.verdict_for(other, repo)[0] is verify.Verdict.MISMATCH
    unknown = record.model_copy(update={"repo_commit": "e" * 40})
    assert verify.verdict_for(unknown, repo)[0] is verify.Verdict.UNKNOWN_COMMIT
    old = record.model_copy(update={"repo_tree": None})
    assert verify.verdict_for(old, repo)[0] is verify.Verdict.UNVERIFIABLE


def test_untracked_helper_files_in_the_copy_are_named_and_the_commit_still_verified(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU-host case of session 4: helper scripts the copy's git did not ignore ran beside the
    commit's files. Verified when this checkout holds the same helper files; a mismatch when any
    tracked file differs or a helper's content here is not what ran."""
    monkeypatch.setenv("HOPPERBENCH_SOURCE_COMMIT", git(repo, "rev-parse", "HEAD"))
    (repo / "scratch").mkdir()
    (repo / "scratch" / "run.sh").write_text("echo run\n")
    record = EnvironmentRecord.model_validate(_repo_state(repo))
    assert record.repo_changes == ["?? scratch/run.sh"]
    verdict, detail = verify.verdict_for(record, repo)
    assert verdict is verify.Verdict.VERIFIED_PLUS_UNTRACKED and "scratch/run.sh" in detail
    (repo / "scratch" / "run.sh").write_text("echo changed since\n")
    assert verify.verdict_for(record, repo)[0] is verify.Verdict.MISMATCH
    (repo / "scratch" / "run.sh").write_text("echo run\n")
    # A file the commit tracks but the copy's older HEAD did not is listed "??" there: not an extra.
    assert verify.untracked_in(["?? kernel.py", "?? scratch/run.sh"]) == ["kernel.py", "scratch/run.sh"]
    assert verify.tracked_by(repo, "HEAD", "kernel.py") and not verify.tracked_by(repo, "HEAD", "scratch/run.sh")
    (repo / "kernel.py").write_text("A = 3\n")
    edited = EnvironmentRecord.model_validate(_repo_state(repo))
    assert verify.verdict_for(edited, repo)[0] is verify.Verdict.MISMATCH


def _commit_results_then_leave_them_out(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A committed results/run.csv, declared as the commit that ran, deleted from the work tree (as a copy that
    left results/ out)."""
    (repo / "results").mkdir()
    (repo / "results" / "run.csv").write_text("a,b\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "results")
    monkeypatch.setenv("HOPPERBENCH_SOURCE_COMMIT", git(repo, "rev-parse", "HEAD"))
    (repo / "results" / "run.csv").unlink()


def test_files_the_copy_left_out_are_counted_and_the_commit_still_verified(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU-host case of sessions 6 and 7: results/ was left out of the copy to fit the transfer
    limit. Verified when the commit's tree less the deleted files is what ran; a mismatch when a
    kept file differs too."""
    _commit_results_then_leave_them_out(repo, monkeypatch)
    record = EnvironmentRecord.model_validate(_repo_state(repo))
    assert record.repo_changes == [" D results/run.csv"]
    verdict, detail = verify.verdict_for(record, repo)
    assert verdict is verify.Verdict.VERIFIED_LESS_DELETED and "results/ (1 listed)" in detail
    (repo / "kernel.py").write_text("A = 2\n")
    edited = EnvironmentRecord.model_validate(_repo_state(repo))
    assert verify.verdict_for(edited, repo)[0] is verify.Verdict.MISMATCH


def test_a_copy_with_helper_files_added_and_results_left_out_is_verified(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both at once: the canonical run's copy carried helper scripts and its runner had removed the
    previous results before it started."""
    _commit_results_then_leave_them_out(repo, monkeypatch)
    (repo / "scratch").mkdir()
    (repo / "scratch" / "run.sh").write_text("echo run\n")
    record = EnvironmentRecord.model_validate(_repo_state(repo))
    assert sorted(record.repo_changes or []) == [" D results/run.csv", "?? scratch/run.sh"]
    verdict, detail = verify.verdict_for(record, repo)
    assert verdict is verify.Verdict.VERIFIED_AS_COPIED
    assert "plus 1 untracked file(s) no commit holds: scratch/run.sh" in detail and "results/ (1 listed)" in detail
    (repo / "scratch" / "run.sh").write_text("echo changed since\n")
    assert verify.verdict_for(record, repo)[0] is verify.Verdict.MISMATCH


def test_a_cut_short_deletion_list_is_verified_by_removing_its_whole_folder(repo: Path) -> None:
    """The copy's status is cut at REPO_CHANGES_LIMIT lines, so it may name only some of the files
    left out; the commit's tree less their folder must still be exactly what ran."""
    (repo / "results").mkdir()
    for name in ("a.csv", "b.csv"):
        (repo / "results" / name).write_text(name)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "results")
    head = git(repo, "rev-parse", "HEAD")
    without_results = verify.tree_without(repo, head, ["results"])
    record = EnvironmentRecord(repo_commit=head, repo_tree=without_results, repo_changes=[" D results/a.csv"])
    verdict, detail = verify.verdict_for(record, repo)
    assert verdict is verify.Verdict.VERIFIED_LESS_DELETED and "all of results/ (1 files listed)" in detail
    only_a = record.model_copy(update={"repo_tree": verify.tree_without(repo, head, ["results/a.csv", "kernel.py"])})
    assert verify.verdict_for(only_a, repo)[0] is verify.Verdict.MISMATCH


def test_files_the_commit_removed_since_the_copys_older_head_do_not_count_as_left_out(repo: Path) -> None:
    """Session 8: the copy's .git sat at an older commit, so its status listed as deleted both the
    results/ it left out and a kernel file the declared commit had removed. Only the first may be
    taken away from the commit's tree; removing the second's whole folder would hide real code."""
    (repo / "kernels").mkdir()
    (repo / "kernels" / "old_candidate.py").write_text("B = 1\n")
    (repo / "kernels" / "kernel.py").write_text("C = 1\n")
    (repo / "results").mkdir()
    (repo / "results" / "a.csv").write_text("a")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "older head")
    git(repo, "rm", "-q", "kernels/old_candidate.py")
    (repo / "results" / "b.csv").write_text("b")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "declared")
    declared = git(repo, "rev-parse", "HEAD")
    ran = verify.tree_without(repo, declared, ["results"])
    changes = [" D kernels/old_candidate.py", " D results/a.csv"]
    record = EnvironmentRecord(repo_commit=declared, repo_tree=ran, repo_changes=changes)
    verdict, detail = verify.verdict_for(record, repo)
    assert verdict is verify.Verdict.VERIFIED_LESS_DELETED and "all of results/" in detail
    without_kernels = record.model_copy(update={"repo_tree": verify.tree_without(repo, declared, ["results", "kernels"])})
    assert verify.verdict_for(without_kernels, repo)[0] is verify.Verdict.MISMATCH


def test_each_track_merged_from_another_run_is_checked_under_its_own_commit(tmp_path: Path, capsys) -> None:
    import json

    results = tmp_path / "latest.json"
    merged = {"environment": {"repo_commit": "a" * 40},
              "track_runs": {"moe": {"environment": {"repo_commit": "b" * 40}}}}  # fmt: skip
    results.write_text(json.dumps(merged))
    assert verify.main([str(results)]) == 0  # neither records a tree: unverifiable, not failed
    assert capsys.readouterr().out.splitlines() == [
        f"{results}: unverifiable: commit {'a' * 40}, no tree recorded",
        f"{results} (moe): unverifiable: commit {'b' * 40}, no tree recorded",
    ]
