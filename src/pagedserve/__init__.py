"""pagedserve: LLM serving with PagedAttention, split into a scheduler and an executor service."""
