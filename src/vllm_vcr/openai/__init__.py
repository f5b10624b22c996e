"""The OpenAI API family as vLLM serves it: chat and text completions, the Responses API,
embeddings/pooling/score/rerank, tokenize/detokenize and models."""
