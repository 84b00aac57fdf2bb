#!/usr/bin/python
"""The pd_apply module: a role's whole desired state for a host, applied in one step.

It runs one of pdctl's host-side steps (as the pd_onhost lookup gives it: argv and stdin) with
the request on its stdin: the apply step (pdctl/onhost/host_apply.py) that converges the host,
the removal step (pdctl/onhost/host_remove.py) that takes a role's service off it for
destroy, or the venv step (pdctl/onhost/venv_install.py) that makes a venv hold its packages.
It turns the step's report into the task's result:
changed, failed with the step's message, the diffs of the files it changed (--diff), check mode
(--check: the step reports and changes nothing). Secret values come in ``secrets``, a no_log
option: Ansible masks them in every output, and they reach the step on its stdin only, never in
an argv or a file.

Beside the playbooks, Ansible finds it for any of them; ansible.cfg names it for a playbook
elsewhere (molecule's config too).
"""

from __future__ import annotations

import json

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: pd_apply
short_description: Apply (or remove) a role's state on a host in one step (pdctl's host_apply)
description:
  - Runs pdctl/onhost/host_apply.py on the host with O(request) (its directories, files, units to
    start, units to wait for) and returns its report. Supports check mode and diff mode.
  - Or, with O(onhost) the removal step, pdctl/onhost/host_remove.py (the units, containers, files,
    lines, users and addresses to take away, and what other services keep).
  - Or, with O(onhost) the venv step, pdctl/onhost/venv_install.py (a venv, the interpreter that
    makes it, its requirements and where they come from).
options:
  onhost:
    description: >-
      The step as the pd_onhost lookup gives it (pdctl.onhost.host_apply,
      pdctl.onhost.host_remove or pdctl.onhost.venv_install): argv and stdin.
    type: dict
    required: true
  request:
    description: >-
      The desired state, or what to remove (each step's module documents its request); the
      module sets check, diff and secrets in it.
    type: dict
    required: true
  secrets:
    description: Secret values by name, for the files whose secret_env names them.
    type: dict
    default: {}
  refuse:
    description: >-
      Problems found on the controller; when any, the module fails with them and changes
      nothing.
    type: list
    elements: str
    default: []
author: pdctl
"""

RETURN = r"""
files:
  description: The paths changed or removed (or that check mode would change or remove).
  type: list
  returned: always
before:
  description: Each unit's ActiveState before the step.
  type: dict
  returned: by the apply step
started:
  description: The units started (check mode, that would be).
  type: list
  returned: by the apply step
active:
  description: The units running once the step is done (those it starts and those already running).
  type: list
  returned: by the apply step
stopped:
  description: The units stopped and disabled (check mode, that would be).
  type: list
  returned: by the removal step
containers:
  description: The containers removed, as "RUNTIME NAME".
  type: list
  returned: by the removal step
users:
  description: The system users removed.
  type: list
  returned: by the removal step
installed:
  description: The requirements installed (check mode, that would be), none when the venv held them.
  type: list
  returned: by the venv step
health:
  description: Each waited unit's last probe (status, state, restarts, journal, probes).
  type: list
  returned: when the request waits
"""


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "onhost": {"type": "dict", "required": True},
            "request": {"type": "dict", "required": True},
            "secrets": {"type": "dict", "default": {}, "no_log": True},
            "refuse": {"type": "list", "elements": "str", "default": []},
        },
        supports_check_mode=True,
    )
    if module.params["refuse"]:
        module.fail_json(msg="; ".join(module.params["refuse"]), changed=False)
    onhost = module.params["onhost"]
    request = dict(
        module.params["request"],
        check=module.check_mode,
        diff=module._diff,
        secrets=module.params["secrets"],
    )
    rc, out, err = module.run_command(
        [str(word) for word in onhost["argv"]],
        data=str(onhost["stdin"]) + json.dumps(request),
        binary_data=True,
    )
    try:
        report = json.loads(out)
    except ValueError:
        module.fail_json(
            msg=f"the host-side step did not report (exit {rc}): {err.strip()[-2000:]}"
        )
    diffs = report.pop("diff", None) or []
    if diffs and module._diff:
        report["diff"] = [{"prepared": text} for text in diffs]
    # Not the arguments back (the bundle and every file's text, per host): what ran and what
    # changed say it; -vvv shows the arguments as they were sent.
    report["invocation"] = {"module_args": {"onhost": {"argv": onhost["argv"]}}}
    if report.pop("failed", False):
        module.fail_json(**report)
    module.exit_json(**report)


if __name__ == "__main__":
    main()
