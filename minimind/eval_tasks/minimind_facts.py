"""Dataset loader of the bundled `minimind_facts` lm-eval task (named by `custom_dataset` in its YAML)."""


def load(data_path=None, **metadata):
    """{"test": Dataset} from the task's jsonl file; lm-eval passes the task metadata (and the model arguments)
    as keyword arguments, of which only `data_path` matters here."""
    from minimind.evaluate import FACTS_DATA, read_facts_task

    return {"test": read_facts_task(data_path or FACTS_DATA)}
