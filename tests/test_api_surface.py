"""The Python API's surface: no secret in any ``repr``/``str``, ``launched`` vs ``Client.serve``, typed
``Client.launch`` keywords (issue 21, item 18).

Notebooks print reprs and save them with the notebook: a key in a repr is a key in a file someone shares.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import re
import warnings
from pathlib import Path

import pytest
from helpers import MODEL

import pbs_toolkit
from pbs_toolkit.client import Client, Endpoint, Job
from pbs_toolkit.jobs.render import RenderRequest
from pbs_toolkit.jobs.status import JobStatus, ServerState
from pbs_toolkit.jobs.store import Intent, JobRecord, JobStore
from pbs_toolkit.services.manage import ServeOptions
from pbs_toolkit.services.record import ServiceRecord, Slot
from pbs_toolkit.services.router.process import RouterInfo
from pbs_toolkit.services.status import ServiceStatus

KEY = "sk-notebook-SECRET-4f2c"
TOKEN = "router-token-SECRET-9a1b"
LOCAL = {"preset": "single", "profile": "local-gpu", "gpus_per_node": 1, "port": "auto"}


def shown(obj: object) -> str:
    return repr(obj) + "\n" + str(obj)


def record(api_key: str | None = KEY) -> JobRecord:
    return JobRecord(job_id="12.vm", scheduler="pbs", profile="generic-pbspro", model=MODEL,
                     served_model_name=MODEL, preset="single", name="qwen", run_dir="/runs/qwen",
                     api_key=api_key, api_key_env="PBSTK_KEY_QWEN")


def test_no_object_of_the_api_shows_a_key() -> None:
    rec = record()
    st = JobStatus(record=rec, state=ServerState.READY, address="10.0.0.5", port=8000)
    router = RouterInfo(host="127.0.0.1", port=41234, prometheus_port=41235, pid=4242, policy="round_robin",
                        run_dir="/runs/router", token=TOKEN)
    service = ServiceRecord(name="qwen", model=MODEL, served_model_name=MODEL, profile="generic-pbspro",
                            replicas=1, request={"model": MODEL, "env": {"HF_TOKEN": TOKEN}},
                            slots=[Slot(0, current="12.vm")], router=router.to_dict(), api_key=KEY)
    objects = {
        "JobRecord": rec,
        "JobStatus": st,
        "Job": Job.from_record(rec),
        "Endpoint": Endpoint(base_url="http://10.0.0.5:8000/v1", api_key=KEY, model=MODEL, job_id="12.vm",
                             env={"OPENAI_API_KEY": KEY}),
        "Intent": Intent(id=1, name="qwen", transport="", run_dir="/runs/qwen", created=0.0, launcher="h:1:2",
                         record=rec),
        "ServiceRecord": service,
        "ServiceStatus": ServiceStatus(record=service, state="READY", ready=1, replicas=[st],
                                       keeper_running=True, router_running=True),
        "ServeOptions": ServeOptions(replicas=2, api_key=KEY),
        "RouterInfo": router,
    }
    for kind, obj in objects.items():
        text = shown(obj)
        assert KEY not in text and TOKEN not in text, f"{kind}: {text}"
    # what the reprs still say: enough to know which job, and that it has a key
    assert "12.vm" in repr(st) and "api_key_env='PBSTK_KEY_QWEN'" in repr(st)
    assert st.record.api_key == KEY and service.router["token"] == TOKEN  # hidden from reprs, not dropped


def _dataclasses() -> list[type]:
    found = []
    for info in pkgutil.walk_packages(pbs_toolkit.__path__, "pbs_toolkit."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        found += [obj for obj in vars(module).values()
                  if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and obj.__module__ == info.name]
    return found


SECRET_FIELD = re.compile(r"(^|_)(api_key|token|secret|password|passphrase)$")


def test_every_secret_field_of_every_dataclass_stays_out_of_its_repr() -> None:
    """A guard for dataclasses added later: a field named like a secret must say ``repr=False``."""
    classes = _dataclasses()
    assert JobRecord in classes and ServiceRecord in classes  # the walk found the package's dataclasses
    leaking = [f"{cls.__module__}.{cls.__name__}.{f.name}" for cls in classes for f in dataclasses.fields(cls)
               if SECRET_FIELD.search(f.name) and f.repr]
    assert not leaking, leaking


def test_a_launched_jobs_status_repr_holds_no_key(standins: Path) -> None:
    # issue 21: ``repr(client.status(job)[0])`` printed the key
    with Client() as client:
        job = client.launch(MODEL, name="reprs", **LOCAL)
        try:
            st = client.status(job)[0]
            key = JobStore().find(job.job_id).api_key
            assert key and st.record.api_key == key
            for obj in (st, st.record, job, client.records()[0]):
                assert key not in repr(obj) and key not in str(obj), obj
        finally:
            client.cancel(job)


# -- launched (was pbs_toolkit.serve) vs Client.serve ------------------------------------------------------------


def test_launched_is_the_new_name_and_serve_warns_but_works() -> None:
    from pbs_toolkit import scoped

    assert pbs_toolkit.launched is scoped.launched
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cm = pbs_toolkit.launched(MODEL, timeout=1)  # nothing runs until the block is entered
    assert hasattr(cm, "__enter__")
    for old in (pbs_toolkit.serve, importlib.import_module("pbs_toolkit.client").serve):
        with pytest.warns(DeprecationWarning, match=r"pbs_toolkit\.serve is now pbs_toolkit\.launched"):
            cm = old(MODEL, timeout=1)
        assert type(cm) is type(pbs_toolkit.launched(MODEL))
    # Client.serve keeps its name: it is ``pbstk serve``, a service of replicas
    assert "replicas" in inspect.signature(Client.serve).parameters


# -- Client.launch's keywords ------------------------------------------------------------------------------------


def test_launch_keywords_are_the_render_request_fields_one_for_one() -> None:
    params = inspect.signature(Client.launch).parameters
    keywords = {name for name, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    # ``models``: a multi-model service's job, written by serve's plan (services/models/multi.py), not a launch option
    fields = {f.name for f in dataclasses.fields(RenderRequest)} - {"model", "preset", "profile", "models"}
    assert keywords == fields | {"api_key", "use_api_key"}
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())  # completion sees them all
    assert params["gpus_per_node"].annotation == "int | None"


def test_a_misspelt_launch_keyword_is_a_type_error_and_launches_nothing(standins: Path) -> None:
    with Client() as client:
        with pytest.raises(TypeError, match="gpus_per_nodes"):
            client.launch(MODEL, preset="single", profile="local-gpu", gpus_per_nodes=1)  # type: ignore[call-arg]
        with pytest.raises(TypeError, match="gpus_per_nodes"):
            pbs_toolkit.launch(MODEL, preset="single", profile="local-gpu", gpus_per_nodes=1)
        assert client.jobs(all=True) == [] and client.unrecorded_launches() == []
