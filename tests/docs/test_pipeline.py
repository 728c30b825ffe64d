"""`pipeline("text-generation", model=dir, trust_remote_code=True)` with chat messages as input."""

import torch
from transformers import pipeline

from conftest import model_dir


def test_text_generation_takes_chat_messages(tmp_path):
    model = model_dir(tmp_path, std=0.3)

    chat = pipeline("text-generation", model=str(tmp_path), trust_remote_code=True)
    assert type(chat.model).__name__ == "MiniMindForCausalLM"
    messages = [{"role": "system", "content": "You are MiniMind."}, {"role": "user", "content": "Hello!"}]
    (result,) = chat(messages, max_new_tokens=6, do_sample=False)

    conversation = result["generated_text"]
    assert conversation[:2] == messages
    assert conversation[-1]["role"] == "assistant"
    # The reply is exactly what the chat template + greedy generate + decode give by hand.
    prompt = chat.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        output = model.generate(**prompt, max_new_tokens=6, do_sample=False)
    expected = chat.tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert conversation[-1]["content"] == expected
