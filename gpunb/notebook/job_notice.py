"""One line above the dashboard of a job: where it runs and how it stands while it waits.

    Job 4242 on slurm (2 nodes x 8 GPUs): PENDING (Priority)
    Attached to job 4242 on slurm, submitted by an earlier run of this cell (--resubmit submits anew): RUNNING

A callback with the follower's own hook, `on_job_state(state, job)`; the line is one
display, updated in place, in plain text (nbconvert and nbval render it).
"""

from __future__ import annotations


class JobNotice:
    def __init__(self):
        self.handle = None
        self.text = None

    def on_job_state(self, state, job: dict) -> None:
        from IPython.display import display

        text = describe(job)
        if text == self.text:
            return
        self.text = text
        if self.handle is None:
            self.handle = display({"text/plain": text}, raw=True, display_id=True)
        else:
            self.handle.update({"text/plain": text}, raw=True)


def describe(job: dict) -> str:
    where = f"job {job['id']} on {job['cluster']}" if job.get("id") else f"a job on {job['cluster']}"
    size = f"{job['nodes']} node{'s' if job['nodes'] != 1 else ''} x {job['tasks_per_node']} " + \
        ("GPU" if job["gpus_per_node"] else "process") + ("es" if not job["gpus_per_node"] and job["tasks_per_node"] != 1
                                                           else "s" if job["tasks_per_node"] != 1 else "")
    state = job["state"] + (f" ({job['reason']})" if job.get("reason") else "")
    if job.get("attached"):
        return (f"Attached to {where} ({size}) of run {job['name']!r}, submitted earlier (`--resubmit` "
                f"submits anew): {state}")
    return f"{where[0].upper()}{where[1:]} ({size}), run {job['name']!r}: {state}"
