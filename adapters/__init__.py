"""Framework adapters (LangChain, LlamaIndex); nothing imports this package."""
